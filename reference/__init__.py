"""The measured reference data, installed as ``autopar.reference_data``: every ``*.csv`` here ships
in the wheel (setup.py). Read a file through ``autopar.reference.data_path(name)``; what each file
holds is in its header and in ``autopar.reference``'s docstring."""
