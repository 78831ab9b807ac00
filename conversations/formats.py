"""Each file format read as a stream, so a multi-GB file is never held in memory: JSONL lines (split on "\\n" alone:
U+2028, U+0085, \\v and friends are text inside a JSON string, not line ends), the elements of one JSON array (or of
an object's "data" array) with their byte offsets, and Parquet or Arrow rows (by row group, or memory-mapped)."""
from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import InputError

__all__ = ["READ_BYTES", "jsonl_lines", "json_kind", "array_values", "arrow_count", "arrow_rows"]

READ_BYTES = 1 << 22  # a file is read in chunks of this many bytes


def _open(path: str | Path) -> Any:
    """Return the file opened for binary reading (a .gz file decompressed; its offsets are of the plain bytes)."""
    import gzip

    return gzip.open(path, "rb") if str(path).lower().endswith(".gz") else open(path, "rb")


def jsonl_lines(path: str | Path, start: int = 0) -> Iterator[tuple[int, int, bytes]]:
    """Yield (1-based line number counted from `start`, byte offset, line without its "\\n") of a file, streamed.

    Lines end at "\\n" alone (a "\\r" before it is dropped): the one line rule of every JSONL file dflash reads or
    writes. Python's str.splitlines() also splits at U+2028, U+0085, \\v, \\f and \\x1c-\\x1e, which are text.
    """
    with _open(path) as f:
        f.seek(start)
        offset, lineno, tail = start, 0, b""
        while chunk := f.read(READ_BYTES):
            parts = (tail + chunk).split(b"\n")
            tail = parts.pop()
            for raw in parts:
                lineno += 1
                yield lineno, offset, raw[:-1] if raw.endswith(b"\r") else raw
                offset += len(raw) + 1
        if tail:
            yield lineno + 1, offset, tail[:-1] if tail.endswith(b"\r") else tail


def json_kind(path: Path, flag: str) -> str:
    """Return "array" for a .json file holding one JSON array (or an object with a "data" array), "jsonl" for JSON
    Lines.

    A JSON Lines row is one line: an object that spans lines is a wrapper ({"version": 1, "data": [...]}), and so is
    a one-line object with a "data" array that is the whole file. A first line that reads as an object of its own
    followed by more rows is JSON Lines.
    """
    with open(path, "rb") as f:
        head = f.read(1 << 16).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        return "array"
    if not head.startswith(b"{"):
        raise InputError(f"{flag} {path}: expected a JSON array of rows (or JSON Lines), found a file starting with "
                         f"{head[:20]!r}; fix the file or write it as JSONL")
    first, end = _first_line(path)
    if end < 0:
        return "array"  # a first line too long for a row: the wrapper's rules
    try:
        text = first.decode("utf-8").rstrip()
        row = json.loads(text)
    except UnicodeDecodeError:
        return "jsonl"
    except json.JSONDecodeError as e:
        # Cut short at the line's end: an object over several lines (the wrapper). Wrong before it: a bad row.
        return "array" if e.pos >= len(text) else "jsonl"
    if not (isinstance(row, dict) and isinstance(row.get("data"), list)):
        return "jsonl"
    with open(path, "rb") as f:  # a one-line object with a "data" array: a wrapper only if nothing follows it
        f.seek(end)
        while chunk := f.read(READ_BYTES):
            if chunk.strip():
                return "jsonl"
    return "array"


def _first_line(path: Path, cap: int = 64 << 20) -> tuple[bytes, int]:
    """Return a file's first non-blank line (without a BOM and its "\\n") and the byte offset past it; (b"", -1) if
    it is longer than `cap` (no row is that long)."""
    with open(path, "rb") as f:
        buf, base = b"", 0
        while True:
            chunk = f.read(READ_BYTES)
            buf += chunk
            while (nl := buf.find(b"\n")) >= 0:
                line = buf[:nl].lstrip(b"\xef\xbb\xbf")
                if line.strip():
                    return line, base + nl + 1
                base, buf = base + nl + 1, buf[nl + 1:]
            if not chunk:
                return buf.lstrip(b"\xef\xbb\xbf"), base + len(buf)
            if len(buf) > cap:
                return b"", -1


class _JsonStream:
    """A JSON file read in chunks: the next character past whitespace, one value decoded at a time, and the byte
    offset of the position (each character is encoded once to count it)."""

    def __init__(self, f: Any, path: Path, flag: str, offset: int) -> None:
        self.f, self.path, self.flag = f, path, flag
        self.decoder = json.JSONDecoder()
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        # buf[mark] lies at byte mark_byte of the file.
        self.buf, self.pos, self.mark, self.mark_byte = "", 0, 0, offset
        self.eof = False

    def more(self) -> bool:
        """Read the next chunk into the buffer; return False at the end of the file."""
        chunk = self.f.read(READ_BYTES)
        try:
            text = self.utf8.decode(chunk, final=not chunk)
        except UnicodeDecodeError as e:
            raise InputError(f"{self.flag} {self.path}: not valid UTF-8 ({e.reason}); fix the file or write it as "
                             "JSONL") from None
        if self.mark > READ_BYTES:  # drop what was read, keeping mark's byte count
            self.byte()
            self.buf, self.pos, self.mark = self.buf[self.mark:], self.pos - self.mark, 0
        self.buf += text
        self.eof = not chunk
        return bool(chunk)

    def byte(self) -> int:
        """Return the byte offset of the position in the file."""
        self.mark_byte += len(self.buf[self.mark:self.pos].encode("utf-8"))
        self.mark = self.pos
        return self.mark_byte

    def peek(self) -> str:
        """Return the next character past JSON whitespace ("" at the end of the file), without taking it."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos:self.pos + 1]

    def take(self, char: str, what: str) -> None:
        """Take `char` as the next character, or raise InputError naming `what` was expected."""
        if self.peek() != char:
            raise self.bad(what)
        self.pos += 1

    def value(self) -> Any:
        """Return the next JSON value, decoded whole."""
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:  # a number at the buffer's end may go on in the next chunk
                    self.pos = end
                    return value
            except json.JSONDecodeError:
                if self.eof:
                    raise self.bad("a JSON value") from None
            self.more()

    def bad(self, what: str) -> InputError:
        return InputError(f"{self.flag} {self.path}: not valid JSON (expected {what} at byte {self.byte()}); fix the "
                          "file or write it as JSONL")

    def elements(self, *, opened: bool) -> Iterator[tuple[int, Any]]:
        """Yield (byte offset, value) of an array's elements up to its closing "]"; opened: the position is just
        past the "[" (else at an element, as an earlier pass yielded it)."""
        if opened and self.peek() == "]":
            self.pos += 1
            return
        while True:
            if self.peek() == "":
                raise self.bad("more elements or the closing ]")
            yield self.byte(), self.value()
            if self.peek() == "]":
                self.pos += 1
                return
            self.take(",", "a comma or the closing ]")


def array_values(path: Path, flag: str, offset: int | None = None) -> Iterator[tuple[int, Any]]:
    """Yield (byte offset, value) of the rows of a .json file, streamed: the elements of its array, or of the "data"
    array of an object (its other keys in any order); from `offset` when given (an element's start, as an earlier
    pass yielded it). The first pass reads the file whole: after the array (or object), only whitespace may follow.
    """
    with open(path, "rb") as f:
        if offset is not None:
            f.seek(offset)
            yield from _JsonStream(f, path, flag, offset).elements(opened=False)
            return
        s = _JsonStream(f, path, flag, 0)
        s.peek()
        if s.buf.startswith("\ufeff", s.pos):
            s.pos += 1
        top = s.peek()
        if top == "[":
            s.pos += 1
            yield from s.elements(opened=True)
        elif top == "{":  # {"data": [...]} and its kin ({"version": 1, "data": [...]}): the rows' key
            s.pos += 1
            found = False
            while s.peek() != "}":
                if s.peek() != '"':
                    raise s.bad("a key")
                key = s.value()
                s.take(":", "a colon")
                if key == "data" and not found and s.peek() == "[":
                    s.pos += 1
                    yield from s.elements(opened=True)
                    found = True
                else:
                    s.value()
                if s.peek() != "}":
                    s.take(",", "a comma or the closing }")
                    if s.peek() == "}":
                        raise s.bad("a key")
            s.pos += 1
            if not found:
                raise InputError(f"{flag} {path}: expected a JSON array of rows or an object with a \"data\" array, "
                                 "found an object without one; fix the file or write it as JSONL")
        else:
            raise s.bad("a JSON array")
        if s.peek() != "":
            raise InputError(
                f"{flag} {path}: expected only whitespace after the JSON {'array' if top == '[' else 'object'} of rows, found more text at byte "
                f"{s.byte()} (two arrays back to back?); join the rows into one array or write them as JSONL")


def _arrow(path: Path, flag: str) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"{flag} {path}: reading Parquet/Arrow needs pyarrow; run `pip install pyarrow`") from None
    return pa, pq


def arrow_count(path: Path, flag: str) -> int:
    pa, pq = _arrow(path, flag)
    try:
        if path.suffix.lower() == ".parquet":
            return pq.ParquetFile(path).metadata.num_rows
        with pa.memory_map(str(path)) as src:
            return _arrow_table(pa, src).num_rows
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{flag} {path}: not a readable {path.suffix[1:]} file ({e}); re-export it") from None


def _arrow_table(pa: Any, src: Any) -> Any:
    # save_to_disk writes the IPC stream format; memory-mapped, read_all() references the map instead of copying.
    try:
        return pa.ipc.open_stream(src).read_all()
    except pa.ArrowInvalid:
        src.seek(0)
        return pa.ipc.open_file(src).read_all()


def arrow_rows(path: Path, flag: str, start: int, stop: int) -> Iterator[dict[str, Any]]:
    """Yield rows start..stop-1 of a Parquet file (by row group) or an Arrow file (memory-mapped)."""
    pa, pq = _arrow(path, flag)
    try:
        if path.suffix.lower() == ".parquet":
            pf = pq.ParquetFile(path)
            first = 0
            for g in range(pf.metadata.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if first + n > start and first < stop:
                    table = pf.read_row_group(g)
                    lo = max(start, first) - first
                    for k in range(lo, min(stop - first, n), 4096):
                        yield from table.slice(k, min(4096, min(stop - first, n) - k)).to_pylist()
                first += n
                if first >= stop:
                    return
            return
        with pa.memory_map(str(path)) as src:
            table = _arrow_table(pa, src)
            for k in range(start, stop, 4096):
                # Converted while the map is open: the table's buffers live in it.
                yield from table.slice(k, min(4096, stop - k)).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{flag} {path}: not a readable {path.suffix[1:]} file ({e}); re-export it") from None
