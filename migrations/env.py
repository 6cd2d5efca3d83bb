import logging
from logging.config import fileConfig

import sqlalchemy as sa
from alembic import context
from flask import current_app
from sqlalchemy import inspect

# this is the Alembic Config object, which provides
# access to the values within the .ini file in use.
config = context.config

# Interpret the config file for Python logging.
# This line sets up loggers basically.
# Keep the application's loggers alive when migrations run inside it (tests, run command).
fileConfig(config.config_file_name, disable_existing_loggers=False)
logger = logging.getLogger("alembic.env")


# The revision ids before the files were renumbered into apply order, and the ids they have
# now. A database upgraded before then holds an old id in alembic_version; it is translated
# once, before Alembic reads it. The new ids ("r0001", ...) share no string with the old
# ones ("0001", ...), whose numbers do not follow the apply order (old 0016 came after old
# 0041), so a translated row is never translated again and no old id is mistaken for a new.
OLD_TO_NEW = {
    "0001": "r0001",
    "0002": "r0002",
    "0003": "r0003",
    "0004": "r0004",
    "0005": "r0005",
    "0006": "r0006",
    "0007": "r0007",
    "0008": "r0008",
    "0009": "r0009",
    "0010": "r0010",
    "0011": "r0011",
    "0012": "r0012",
    "0013": "r0013",
    "0014": "r0014",
    "0015": "r0015",
    "0030": "r0016",
    "0031": "r0017",
    "0040": "r0018",
    "0041": "r0019",
    "0016": "r0020",
    "0042": "r0021",
    "0043": "r0022",
    "0044": "r0023",
    "0045": "r0024",
    "0046": "r0025",
    "0047": "r0026",
    "0048": "r0027",
    "0049": "r0028",
    "0050": "r0029",
    "0051": "r0030",
    "0052": "r0031",
}


def translate_old_revision_ids(connection, version_table="alembic_version", schema=None):
    """Rewrite an old revision id in the version table to its new id, in a transaction of
    its own: it then holds even when nothing is left to apply or a later migration fails
    (the new id names the same schema)."""
    with connection.begin():
        if not inspect(connection).has_table(version_table, schema=schema):
            return
        table = sa.table(version_table, sa.column("version_num"), schema=schema)
        for old in connection.scalars(sa.select(table.c.version_num)).all():
            new = OLD_TO_NEW.get(old)
            if new is None:
                continue
            connection.execute(
                table.update().where(table.c.version_num == old).values(version_num=new)
            )
            logger.info("Translated revision %s of the old numbering to %s", old, new)


def get_engine():
    return current_app.extensions["migrate"].db.engine


def get_engine_url():
    try:
        return get_engine().url.render_as_string(hide_password=False).replace("%", "%%")
    except AttributeError:
        return str(get_engine().url).replace("%", "%%")


# add your model's MetaData object here
# for 'autogenerate' support
# from myapp import mymodel
# target_metadata = mymodel.Base.metadata
config.set_main_option("sqlalchemy.url", get_engine_url())
target_db = current_app.extensions["migrate"].db

# other values from the config, defined by the needs of env.py,
# can be acquired:
# my_important_option = config.get_main_option("my_important_option")
# ... etc.


def render_item(type_, obj, autogen_context):
    """Render our UTC type as the plain timestamptz it stores, so migrations need no app import."""
    from portal.models.base import UTCDateTime

    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def get_metadata():
    if hasattr(target_db, "metadatas"):
        return target_db.metadatas[None]
    return target_db.metadata


def run_migrations_offline():
    """Run migrations in 'offline' mode.

    This configures the context with just a URL
    and not an Engine, though an Engine is acceptable
    here as well.  By skipping the Engine creation
    we don't even need a DBAPI to be available.

    Calls to context.execute() here emit the given string to the
    script output.

    """
    url = config.get_main_option("sqlalchemy.url")
    context.configure(url=url, target_metadata=get_metadata(), literal_binds=True)

    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online():
    """Run migrations in 'online' mode.

    In this scenario we need to create an Engine
    and associate a connection with the context.

    """

    # this callback is used to prevent an auto-migration from being generated
    # when there are no changes to the schema
    # reference: http://alembic.zzzcomputing.com/en/latest/cookbook.html
    def process_revision_directives(context, revision, directives):
        if getattr(config.cmd_opts, "autogenerate", False):
            script = directives[0]
            if script.upgrade_ops.is_empty():
                directives[:] = []
                logger.info("No changes in schema detected.")

    conf_args = current_app.extensions["migrate"].configure_args
    if conf_args.get("process_revision_directives") is None:
        conf_args["process_revision_directives"] = process_revision_directives

    conf_args.setdefault("render_item", render_item)
    conf_args.setdefault("compare_type", True)
    connectable = get_engine()

    with connectable.connect() as connection:
        translate_old_revision_ids(
            connection,
            conf_args.get("version_table", "alembic_version"),
            conf_args.get("version_table_schema"),
        )
        context.configure(connection=connection, target_metadata=get_metadata(), **conf_args)

        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
