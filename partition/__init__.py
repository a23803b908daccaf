"""Cutting a training step into partitions and running it: schedules of actions as
data (``partition.schedule``) and the one-device executor (``partition.local``)."""
