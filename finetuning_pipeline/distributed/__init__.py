"""The distributed runtime: launching the replicas (a process per chip, a thread per device),
the parallel modes (dp, fsdp over an SPMD mesh), the collectives between replicas and hosts,
and the hosts' agreement before a run starts. The one seam a second backend (TorchTPU)
replaces; everything above it asks it, not torch_xla, how many replicas there are and how
to sum across them."""
