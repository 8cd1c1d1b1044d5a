"""What runs inside each rank, and the files it exchanges with its parent (``protocol``). Imported in
every session (the plugin also runs in the ranks): keep it light."""
