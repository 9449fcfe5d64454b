"""Speed measurements: per-layer timing, training and inference throughput against the device's
measured peak, the data loader, and the CPU-versus-GPU scaling study of the second seed."""
