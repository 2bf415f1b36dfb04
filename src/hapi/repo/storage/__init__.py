"""What the repository keeps in the object store, and how it is read and written.

The key layout, tensor blobs and their codecs, manifests and the module trees they record,
reference syntax, delta markers, the epoch and change tokens, and push/gc locks. Nothing
here knows about the catalog or the operations built on top.
"""
