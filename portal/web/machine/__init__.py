"""The machine endpoints: the JSON API and its OpenAPI document, the seed's operator endpoints,
provider webhooks, health and metrics."""
