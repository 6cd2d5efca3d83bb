"""The records pages: mail and SMS lists, search, detail, retry and cancel (one machinery with a
channel parameter), what a status means and what to do, and the records awaiting a decision."""
