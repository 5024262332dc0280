"""The repository (object store + catalog + refs), opening a store directory, and loading states back."""
