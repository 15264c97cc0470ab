// A file that .clang-format would change (the control of docs.format: the check must refuse it). Not
// compiled; scripts/check_format.py leaves tests/format/ out of the tree's check.
int  add( int a,int b ){return a+b ;}
