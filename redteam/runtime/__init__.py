"""Where jobs run: the state folder, worker processes, Ray, the allocator and limits."""
