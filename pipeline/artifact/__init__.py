"""The artifact format shared by the writer (``pipeline.export``) and the reader
(``pipeline.runtime``): tensor layouts, packing, ``manifest.json``."""
