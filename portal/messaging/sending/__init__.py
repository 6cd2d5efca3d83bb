"""Sending: the claim of a due record, its preparation (template, route, quota), the send through
a transport, and the outcome's write (Sent, deferred with backoff, failed), with what guards the
path: the breaker, rate limits, the sweeper of stuck claims, server health and the outbound
address policy."""
