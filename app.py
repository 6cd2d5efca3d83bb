"""The portal's WSGI entry point: ``flask --app app run`` or ``gunicorn app:app``."""

import os

from portal import create_app
from portal.logs import configure_logging

configure_logging(os.environ.get("LOG_LEVEL", "INFO"))
app = create_app()
