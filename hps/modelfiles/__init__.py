"""Model files: where they are (local, S3, HDFS sources) and how they are written (formats)."""
