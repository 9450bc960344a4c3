"""The benchmark programs ``pagedkv bench alloc|kernel|linear|e2e`` runs, one module each."""
