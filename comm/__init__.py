"""specloop.comm"""
