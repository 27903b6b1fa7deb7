"""Processes and their collectives: the runtime (who am I), the mesh, every collective (comm), fault watching."""
