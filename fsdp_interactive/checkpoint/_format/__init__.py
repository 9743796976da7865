"""The file format of checkpoints and snapshots, in one place.

* :mod:`._manifest`: ``manifest.json`` (``FORMAT_VERSION``), the file that marks a
  checkpoint folder complete: every file's size and checksum, the algorithm named;
* :mod:`._checksums`: the checksum algorithms a manifest may name, and hashing a file;
* :mod:`._raw_storage`: the raw storage format snapshots write (DCP's metadata, each
  tensor's bytes as they are in memory, one file per rank);
* :mod:`._safe_reader`: reading both storage formats back without unpickling arbitrary
  objects;
* :mod:`._snapshot_record`: a snapshot's ``snapshot.json`` (``RECORD_VERSION``);
* seals: :mod:`._seal_json` (the file a seal is written in), :mod:`._snapshot_seal` (a
  snapshot's, under the pool's key), :mod:`._owner_seal` (a disk checkpoint's, under the
  user's key, :mod:`._owner_key`);
* :mod:`._prechecked`: checksums of a snapshot's files taken ahead of a restore, and the
  record they are kept in.

The modules that read and write no tensor (checksums, manifest, seals, keys, the
prechecked record) import neither torch nor the rest of the checkpoint package, so that
the kernel (a pool's checkpoint key) and an engine forker's child (a precheck) import
only what they use.
"""
