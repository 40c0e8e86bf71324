"""The engine core's loop and how fronts reach it: in a thread of the server's process or
in a process of its own (--engine-process), through one client."""
