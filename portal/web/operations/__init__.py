"""The operations pages: dashboard, quotas, dead letters, suppressions, API keys, users, the audit
log and the inbox."""
