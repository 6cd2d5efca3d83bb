"""After the send: what comes back. A bounce mailbox read over IMAP (DSN bounces, read
receipts), stored once per message and applied to the send record it is about."""
