"""The runtime every service stands on: process wiring, actor instances, posting, joins."""
