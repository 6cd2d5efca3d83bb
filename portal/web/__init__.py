"""Blueprints: one module per page group, plus the JSON API."""

from __future__ import annotations

from flask import Flask


def register_blueprints(app: Flask) -> None:
    """Import and register every blueprint (imports here keep the factory cheap to import)."""
    from portal.web import api, health, metrics, operator_api

    app.register_blueprint(api.bp)
    app.register_blueprint(health.bp)
    app.register_blueprint(operator_api.bp)
    app.register_blueprint(metrics.bp)
    api.init_app(app)
