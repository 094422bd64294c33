"""Token datasets: prepared once into the store, then read lazily by every worker.

A dataset is ``dataset.json`` (format ``diloco-flows/dataset/2``) over a stream
of tokens held in flat token shards: its files are consecutive ranges of that
stream, and the last ``val_fraction`` of every file's tokens is held out for
validation (so both splits see every file).

Preparing (`workers.data.prepare.prepare_data`, or ``python -m workers.data
prepare``):

- text files (and Parquet/Arrow tables, `workers.data.tables`) are read in blocks
  and tokenised as they stream; the tokens go to flat objects ``tokens/00000.bin``
  ... of at most 64 MiB (uint16, or uint32 when the vocabulary has more than
  65536 ids), each with a crc32c per 64 KiB block and a sha256; a tokenizer file
  is copied to ``tokenizer.json``. Memory stays bounded whatever the corpus size,
  and progress is reported in bytes.
- token shards users already have (nanoGPT ``.bin``, llm.c-header ``.bin``,
  ``.npy``) are indexed where they are, not copied: one streaming pass checks
  every id against the vocabulary and records the block checksums. Local shards
  are copied into a remote (S3) dataset store, which other machines can read.

``dataset.json`` is written last, create-only: a dataset is never overwritten.

Reading (`workers.data.streams.open_dataset`) reads only the index; the tokens
are `workers.data.lazy.LazyTokens`, fetched block by block (local ``pread``,
remote ranged reads), checked against their crc32c, through an LRU cache that
bounds a worker's memory. `WorkerStream` gives one worker its part of the train
tokens, as random windows that are a pure function of (seed, worker, batch
index), so a resumed worker sees exactly the batches it would have seen, and the
next batch is read ahead in the background. `val_batches` gives every party the
same fixed windows. A ``dataset.json`` of any other format (one prepared by an
older version) is refused with one line saying to prepare the data again.

The modules, one job each:

    sources.py    finding the text files and tables (paths, globs, fsspec URLs,
                  ``builtin:shakespeare``)
    token_shards.py  finding and indexing token shards (.bin, .npy)
    index.py      preparing a dataset from shards: the index, and copies
    writer.py     streaming text into token shards
    tables.py     Parquet/Arrow sources
    prepare.py    `prepare_data` and the ``prepare`` command
    lazy.py       reading shards: verified blocks, the cache, `LazyTokens`
    streams.py    `open_dataset`, `WorkerStream`, `val_batches`: what a worker reads
    manifest.py   the ``dataset.json`` schema both sides share
    errors.py     `DataError` and its subclasses

Run ``python -m workers.data prepare --help`` for the command line.
"""
