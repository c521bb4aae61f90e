"""Re-creations of peer engines' metadata paths, written here from their documented designs
(not from their code), for same-process comparison with this library: the benchmarks run a
peer's way of building and uploading a step's metadata beside the library's, interleaved in
one process, over the same workload."""
