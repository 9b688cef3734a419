"""What a user runs besides the launch: `python -m launcher.jobs` (status, logs, cancel), `launcher.export`,
`launcher.sweep`, `launcher.doctor`, and the summary the launch prints."""
