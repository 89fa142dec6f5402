"""What the machine gives a process: GPUs, cores and memory, addresses and routes, the processes
we started. Standard library only, and no torch: the notebook kernel and the ranks both use it."""
