"""How the workers start: one module per launch backend behind the interface of base.py (local: torch's elastic
agent on this machine or on each node; slurm: submitit; ray: the Jobs API), and what they share on a node (the
agent, the replica groups and their Lighthouse, a script's command, the network)."""
