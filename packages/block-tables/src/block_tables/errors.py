"""Exceptions raised by block tables and page-table snapshots.

Every error raised by :meth:`PageTableSnapshot.prepare` is raised before any host write:
a rejected batch leaves the storage bytes, the revision, the recorded row state and the
change history exactly as they were.
"""

from __future__ import annotations


class BlockTableError(ValueError):
    """Base class of every error this package raises on bad input.

    ``row`` is the index of the offending row in the batch, or ``None`` when the error is
    not about one row (a storage or constructor argument, a standalone ``BlockTable``).
    """

    def __init__(self, message: str, *, row: int | None = None) -> None:
        super().__init__(message)
        self.row = row


class StorageError(BlockTableError):
    """The snapshot storage is not a writeable, C-contiguous 2-D int32 array."""


class RowCountError(BlockTableError):
    """The batch has more rows than the storage, or ``required_pages`` has the wrong length."""


class RowWidthError(BlockTableError):
    """A row holds more page IDs than the storage has columns (or than a row can encode)."""


class RowTypeError(BlockTableError, TypeError):
    """A row (or page-ID argument) is not a BlockTable, a 1-D integer array or a list of ints."""


class PageIdRangeError(BlockTableError):
    """A page ID lies outside ``[0, pool_limit)``, or does not fit int32."""


class ReservedPageError(PageIdRangeError):
    """A real row holds the snapshot's reserved page (padding storage: only graph padding
    rows hold it)."""


class MissingPagesError(BlockTableError):
    """A request span needs more pages than its row holds (``required_pages[i] > len(row)``)."""



class VersionExhaustedError(BlockTableError, RuntimeError):
    """The process-wide version source ran past the largest encodable version."""
