"""Code that runs inside the user's ranks. Import-light, and it never breaks the user's program."""
