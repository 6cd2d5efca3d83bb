"""Migrations 0013 and 0014 on existing templates: they stay non-strict (live callers
keep working) and each gets its current content as its first version, attachments by hash."""

from __future__ import annotations

import base64
import hashlib
import json

from flask_migrate import downgrade, upgrade
from sqlalchemy import text

from portal.extensions import db
from tests.conftest import make_app
from tests.integration.test_migrations import _dispose, throwaway_pg_url

__all__ = ["throwaway_pg_url"]


def test_existing_templates_stay_lenient_and_get_a_first_version(throwaway_pg_url: str) -> None:
    app = make_app(throwaway_pg_url)
    attachment = {"name": "a.txt", "contentType": "text/plain", "content": "aGk="}
    try:
        with app.app_context():
            downgrade(revision="r0012")
            with db.engine.begin() as connection:
                tenant = connection.execute(
                    text("INSERT INTO tenant (slug, name) VALUES ('t', 'T') RETURNING id")
                ).scalar_one()
                connection.execute(
                    text(
                        "INSERT INTO mail_template (tenant_id, code, name, subject, html_body, "
                        "version, attachments) VALUES (:t, 'hi', 'Hi', 'Hi {{ name }}', '<p>x</p>',"
                        " 4, CAST(:a AS json))"
                    ),
                    {"t": tenant, "a": json.dumps([attachment])},
                )
                connection.execute(
                    text(
                        "INSERT INTO sms_template (tenant_id, code, name, content) "
                        "VALUES (:t, 'otp', 'OTP', 'Code {{ code }}')"
                    ),
                    {"t": tenant},
                )
            upgrade()
            with db.engine.connect() as connection:
                strict = connection.execute(
                    text("SELECT strict_variables FROM mail_template UNION ALL "
                         "SELECT strict_variables FROM sms_template")
                ).scalars().all()  # fmt: skip
                assert strict == [False, False]
                rows = connection.execute(
                    text("SELECT channel, number, content FROM template_version ORDER BY channel")
                ).all()
                assert [(r[0], r[1]) for r in rows] == [("mail", 4), ("sms", 1)]
                mail = rows[0][2] if isinstance(rows[0][2], dict) else json.loads(rows[0][2])
                digest = hashlib.sha256(base64.b64decode("aGk=")).hexdigest()
                assert mail["subject"] == "Hi {{ name }}"
                assert mail["attachments"] == [
                    {"name": "a.txt", "contentType": "text/plain", "sha256": digest}
                ]
                blob = connection.execute(
                    text("SELECT content, size FROM template_blob WHERE sha256 = :h"), {"h": digest}
                ).one()
                assert tuple(blob) == ("aGk=", 2)
    finally:
        _dispose(app)
