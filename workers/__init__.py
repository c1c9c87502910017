"""Process entry points: each parses its flags, builds one actor and runs it until a signal."""
