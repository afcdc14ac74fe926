"""The export pipeline: checkpoint in, checked model folder out (`exporter.export_model`)."""
