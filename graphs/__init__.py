"""specloop.graphs"""
