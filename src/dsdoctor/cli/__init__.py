"""The thin shell: each module validates flags, makes one library call, renders the result."""
