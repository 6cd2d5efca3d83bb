"""The portal's WSGI entry point: ``flask --app app run`` or ``gunicorn app:app``."""

from portal import create_app

app = create_app()
