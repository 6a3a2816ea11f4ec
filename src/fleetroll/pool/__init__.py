"""The pool: batches, their executors (local and Ray), the journal and pre-flight."""
