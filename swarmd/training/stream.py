"""Moved to :mod:`swarmd.data.stream` (and the readers to :mod:`swarmd.data.records`); kept so
that ``from swarmd.training.stream import ...`` goes on working."""

from swarmd.data.records import Record, data_files, read_records
from swarmd.data.stream import DataPosition, TokenStream, load_position, save_position

__all__ = ["DataPosition", "Record", "TokenStream", "data_files", "read_records",
           "save_position", "load_position"]
