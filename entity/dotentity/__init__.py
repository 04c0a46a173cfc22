"""The `.entity` format: the container (`container`: prefix, checksummed header, aligned blobs;
its schema in `header`), which blobs a transformer is made of and their encodings (`blobs`,
GGUF blocks kept as they are in `native_blocks`), the writer (`write`), the reader (`read`) and
Loom's v1 files (`v1`). Byte layouts: docs/formats.md."""
