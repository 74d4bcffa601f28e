"""Planning before paying: compile for a topology, memory, hardware peaks, the planner."""
