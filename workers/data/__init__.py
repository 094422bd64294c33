"""Token datasets: prepared once into the store, then read by every worker.

Preparing (`workers.data.prepare.prepare_data`, or ``python -m workers.data
prepare``) reads text files, tokenises them file by file, holds out the last
``val_fraction`` of every file's tokens for validation (so both splits see every
file) and writes, under one store URL::

    train/tokens    every file's train tokens, concatenated (uint16, or uint32
                    when the vocabulary has more than 65536 ids)
    train/offsets   int64, where each file's train tokens start, plus the end
    val/tokens      the held-out tails, concatenated in the same file order
    val/offsets
    dataset.json    written last, create-only: tokenizer, dtype, files with their
                    sizes in bytes and tokens, counts, the arrays' object records

Arrays go through `storage.arrays` (lossless, crc32c per chunk, sha256 per object
checked on read). A dataset is never overwritten: without ``dataset.json`` the
arrays are unreferenced leftovers that the next prepare replaces.

Reading (`workers.data.streams.open_dataset`) loads the verified arrays into
memory. `WorkerStream` gives one worker its part of the train tokens, as random
windows that are a pure function of (seed, worker, batch index), so a resumed
worker sees exactly the batches it would have seen. `val_batches` gives every
party the same fixed windows.

The modules, one job each:

    sources.py    finding and reading the text files (paths, globs, fsspec URLs,
                  ``builtin:shakespeare``)
    prepare.py    `prepare_data` and the ``prepare`` command
    streams.py    `open_dataset`, `WorkerStream`, `val_batches`: what a worker reads
    manifest.py   the ``dataset.json`` schema both sides share
    errors.py     `DataError` and its subclasses

Run ``python -m workers.data prepare --help`` for the command line.
"""
