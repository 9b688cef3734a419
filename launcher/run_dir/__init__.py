"""The run directory: its stable name and the checks that it is ours to write (directory.py), and who writes it
now (lease.py)."""
