"""Pipeline parallelism (``parallel.pp``): schedules as checked action lists and their executor."""
