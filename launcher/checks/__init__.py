"""What is checked before any process starts: the typed config and its values (validate.py), every `_target_`'s
arguments, one batch through the model and the loss, the trackers' logins, the memory forecast of a dry run."""
