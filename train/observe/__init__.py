"""Seeing inside a run: the console, metrics and the experiment trackers they feed, throughput, profiler traces,
the hang watchdog and its reports, the run's status file."""
