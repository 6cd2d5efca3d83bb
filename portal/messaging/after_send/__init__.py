"""After the send: delivery events (bounces, complaints, provider receipts), the bounce mailbox
reader, suppression of recipients that are gone, status callbacks to tenants' endpoints, and the
inbox of notices for people."""
