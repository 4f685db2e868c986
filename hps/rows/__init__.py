"""Row formats: how an embedding row is stored (`embedding_storage_dtype`) in every tier."""
