"""Records: how a message enters (acceptance, validation, addresses), what a user does to it
afterwards (cancel, retry, resolve a doubtful send), how it is found and kept (search,
retention), and how its story is told (timeline, diagnosis)."""
