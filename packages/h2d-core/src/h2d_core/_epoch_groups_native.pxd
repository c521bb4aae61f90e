# The C declarations of epoch_groups.py (compiled as h2d_core._epoch_groups_native): what
# one epoch produced and published, which the compiled epoch (epoch.py) calls through C.
# Meanings: epoch_groups.py.
cdef class EpochGroups:
    cdef readonly dict producer_groups
    cdef readonly dict counters
    cdef readonly set produced
    cdef readonly set published
    cdef readonly tuple all_names
    # producer group lists already checked by enter (the multi-group fast path)
    cdef set _known_lists
    # the groups enter checked last
    cdef object _last
    cdef dict _on_publish
    cdef dict _stagers
    cpdef open(self)
    cpdef list enter(self, tuple groups, object reason, long long epoch, Py_ssize_t slot)
    cpdef require_unpublished(self, str group, frozenset names, long long epoch)
    cpdef published_now(self, frozenset names, tuple name_list, list records)
