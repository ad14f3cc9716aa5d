"""Shared numeric primitives of the retrieval methods: batched k-means (``kmeans``), product
quantization and PQ search (``pq``), and an optional faiss-cpu backend (``faiss_backend``, imported
only on request)."""
