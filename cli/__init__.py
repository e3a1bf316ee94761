"""Click commands only: flags -> a library call -> a table on stderr or one JSON object."""
