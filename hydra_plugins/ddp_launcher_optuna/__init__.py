"""`hydra/sweeper=optuna`: a study whose trials are runs of this launcher (hydra_plugins/ddp_launcher_optuna/
optuna_sweeper.py). Hydra loads sweepers from the `hydra_plugins` namespace package only."""
