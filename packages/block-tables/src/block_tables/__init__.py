"""block_tables: block-table lineage and incremental page-table snapshots (numpy only).

``BlockTable`` carries one request's page IDs and an append-lineage version;
``PageTableSnapshot`` keeps fixed int32 storage equal to a batch of rows while writing
only what changed, and reports a revision and the changed rows for publication.
"""

from .errors import (
    BlockTableError,
    MissingPagesError,
    PageIdRangeError,
    ReservedPageError,
    RowCountError,
    RowTypeError,
    RowWidthError,
    StorageError,
    VersionExhaustedError,
)
from .lineage import MAX_ROW_LENGTH, BlockTable, draw_version
from .snapshot import ChangedRows, PageTableSnapshot
from .staging import PublishedTable, TableStaging

__all__ = [
    "MAX_ROW_LENGTH",
    "BlockTable",
    "BlockTableError",
    "ChangedRows",
    "MissingPagesError",
    "PageIdRangeError",
    "PageTableSnapshot",
    "PublishedTable",
    "ReservedPageError",
    "RowCountError",
    "RowTypeError",
    "RowWidthError",
    "StorageError",
    "TableStaging",
    "VersionExhaustedError",
    "draw_version",
]
