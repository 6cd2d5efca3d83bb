"""The configuration pages: mail servers, SMS providers and routes, bounce mailboxes, mail and
SMS templates, status-callback endpoints and retention."""
